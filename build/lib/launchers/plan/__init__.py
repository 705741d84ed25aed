"""What a sweep would do, computed without side effects: cells.py (a cell and its id), grid.py (the
expansion), rules.py (a cell's state -> its action: the one table), render.py (`sweep plan`)."""
