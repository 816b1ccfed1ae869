"""One module per `tandem` subcommand: each adds its parser and runs it."""
