"""Text: the tokenizer (tokenizers or tiktoken vocabularies, chat templates), the incremental detokenizer, and the grammar engine's token masks (llguidance)."""
