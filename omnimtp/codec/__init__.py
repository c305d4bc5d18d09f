"""Code2wav: streamed decoding of codec frames to 24 kHz audio."""
