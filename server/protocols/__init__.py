"""Other wire formats (OpenAI embeddings, KServe v2) over the one inference path."""
