"""crawl2chat."""

from crawl2chat.stages.telemetry import disable_telemetry

# Before any library that reports usage is imported, whatever the entry point.
disable_telemetry()
