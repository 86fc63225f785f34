"""The API process: the OpenAI server, the offline `LLM` front end, tokenization, output processing and detokenization."""
