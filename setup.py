"""C extensions; everything else is declared in pyproject.toml."""
from setuptools import Extension, setup

EXTENSIONS: list[Extension] = []

setup(ext_modules=EXTENSIONS)
