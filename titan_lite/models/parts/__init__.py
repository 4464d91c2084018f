"""The parts a decoder block is composed of: mixers, feed-forwards, norms, rope, masks."""
