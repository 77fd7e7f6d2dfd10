"""The replica: the managers an engine's scheduler calls, and joining a cluster.
"""
