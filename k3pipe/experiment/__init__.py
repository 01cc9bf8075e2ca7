"""An experiment read and checked: loading a file (and its secrets), variants, a flow's run request
and overrides, preflight, speculation's pairing. Imports schema, engines and below."""
