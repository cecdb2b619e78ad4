"""OpenAI's APIs: chat and completions, Responses, embeddings."""
