"""The built-in transforms, one module each; they import the core only, never each other."""
