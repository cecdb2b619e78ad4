"""OpenAI's APIs: chat and completions, Responses, and the server's own routes in OpenAI's shapes."""
