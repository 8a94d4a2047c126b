"""slimgrad.ops"""
