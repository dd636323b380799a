"""`kmesh serve`: an OpenAI-compatible HTTP server over the reference engine or vLLM."""
