"""Text <-> token ids: tokenizers (bytes, SentencePiece, tokenizer.json), the chat
template, and streamed decoding of a reply."""
