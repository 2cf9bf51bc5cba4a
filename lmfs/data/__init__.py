"""Data for the lectures: embedded corpora now; extraction, filtering and dedup as lectures 13-14 land."""
