"""The data layer: the pinned inputs and their fetching, and the book's three datasets as the tokenize stage writes them."""
