"""Who holds an object, named in the user's own words, and which code is the user's."""
