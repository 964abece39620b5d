"""`tensorfleet gateway`: one OpenAI endpoint in front of every InferenceService's router. Design: docs/gateway.md."""
