"""KMesh inside vLLM 0.32, as an extension (no fork): the KV connector and its configuration."""
