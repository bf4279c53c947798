"""The process toolkit: engine processes, a local HTTP server, secrets kept out of sight, shell
lines, terminal-safe text, TOML for people, paths described."""
