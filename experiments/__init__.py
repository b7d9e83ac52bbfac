"""The scripts behind the make targets (`python -m experiments.<name>`); not installed with the package."""
