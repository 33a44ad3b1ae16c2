"""The three datasets of the book, prepared by the tokenize stage and read back by training.

verdict: The Verdict as token ids, in sliding windows for next-token pretraining (chapters 2 and 5).
spam: the SMS Spam Collection, balanced and padded for classification (chapter 6).
instruct: Alpaca-style instruction records and their collate function (chapter 7).
"""
