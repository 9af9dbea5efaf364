"""The ``ccft`` command line: one module per subcommand."""
