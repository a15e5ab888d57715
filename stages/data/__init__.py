"""The data pipeline: crawl or WARC/WET input -> extract -> language ID -> quality -> dedup -> balance -> shards."""
