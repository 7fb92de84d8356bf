"""Experiments run on the product package; nothing in it imports them."""
