"""The `hisparse` command line: one module per subcommand, each exposing `register(subparsers)`."""
