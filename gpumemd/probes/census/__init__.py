"""The tensor census: every live tensor counted once, classified, grouped, its graphs weighed."""
