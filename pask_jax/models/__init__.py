"""Model code: the NNX decoder, checkpoint loading, fetching, tokenizers and the chat template."""
