"""The statistics (ground floor, beside core): verdicts between arms, series of retests, capacity
searches' arithmetic and the agreement of answers. Imports core alone."""
