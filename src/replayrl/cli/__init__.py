"""The `replayrl` command line."""
