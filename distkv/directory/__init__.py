"""The Directory: which replicas of a cache namespace hold which blocks, both sides of its wire.
"""
