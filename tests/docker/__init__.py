"""Tests on the isolated dockerd and the local registry (`make test` starts both)."""
