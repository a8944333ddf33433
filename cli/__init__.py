"""The `kvatlas` command line: one module per subcommand (`kvatlas --help` lists them); the top of
the import graph (schemas <- indexer <- router_api <- router <- cli; producer <- sim)."""
