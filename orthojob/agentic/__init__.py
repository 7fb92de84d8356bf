"""The environment as TRL tools (``--mode agentic``): in-process or through the server."""
