"""leat-example: a template leat plugin."""
