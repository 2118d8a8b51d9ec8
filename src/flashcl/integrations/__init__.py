"""Drop-in call conventions of the libraries people already train with."""
