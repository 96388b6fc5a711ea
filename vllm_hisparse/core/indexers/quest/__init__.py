"""Quest (page-level): min/max key bounds per page; a page's score is an upper bound of q.k."""
