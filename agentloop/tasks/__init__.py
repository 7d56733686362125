"""Tasks built on the library (data, tools, rewards, warm starts); configs name them by dotted path."""
