"""The serving layer: the OpenEnv adapter, the fast path, middleware, handlers, sessions, settings."""
