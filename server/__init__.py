"""The OpenAI-compatible HTTP server on pagechat's engine (`pagechat serve`)."""
