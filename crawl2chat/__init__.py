"""crawl2chat."""
