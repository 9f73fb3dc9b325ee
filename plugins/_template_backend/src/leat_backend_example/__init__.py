"""leat-backend-example: a template leat backend plugin."""
