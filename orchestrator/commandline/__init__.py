"""The command-line layer: options turned into requests (cli) and the fabtrain program."""
