"""decoders"""
