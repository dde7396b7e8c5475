"""proposers"""
