"""pagechat's command line and terminal app."""
