"""The `tqstore` command (installed as the import package `tqstore_cli`)."""
