"""slimgrad.bench"""
