"""`python -m plies`: the `plies` command, for when only the interpreter is at hand.

Child processes use this form (`plies.testing.plies_command`) so they run the same
interpreter and install as their parent, whatever the PATH says.
"""

from plies.cli import app

if __name__ == "__main__":
    app(prog_name="plies")
