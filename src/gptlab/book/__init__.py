"""The book layer: the reproduction report, the book's figures and its chapter demos."""
