"""pagechat.cli: the command line (typer), apart from the app it opens."""
