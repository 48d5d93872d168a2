"""Read official model directories safely; convert them to the fast bundle; open bundles."""
