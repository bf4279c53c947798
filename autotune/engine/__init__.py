"""What an engine is to the core: the backend and its parts and records, engine models, the
declarations (formats, cache types, rules, space), memory arithmetic, metrics and strategies."""
