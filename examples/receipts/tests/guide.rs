//! `docs/adopting.md` shows this crate's files: every block of the page labelled with a file of
//! the crate must be that file (or, labelled as an excerpt, a part of it, verbatim), and every
//! Rust block must be labelled, so that no Rust on the page goes uncompiled.

use std::path::Path;

const GUIDE: &str = include_str!("../../../docs/adopting.md");

/// A fenced block of the page: its language, its text, and the label line above it.
struct Block {
    language: String,
    text: String,
    label: Option<String>,
}

fn blocks(page: &str) -> Vec<Block> {
    let mut blocks = Vec::new();
    let mut lines = page.lines();
    let mut previous: Vec<&str> = Vec::new();
    while let Some(line) = lines.next() {
        let Some(language) = line.strip_prefix("```") else {
            if !line.trim().is_empty() {
                previous.push(line);
            }
            continue;
        };
        let text: Vec<&str> = lines.by_ref().take_while(|l| *l != "```").collect();
        let label = previous
            .last()
            .filter(|l| l.starts_with('`') && l.ends_with(':'))
            .map(|l| l.to_string());
        blocks.push(Block {
            language: language.to_owned(),
            text: text.join("\n") + "\n",
            label,
        });
        previous.clear();
    }
    blocks
}

#[test]
fn every_labelled_block_of_the_guide_is_the_crates_file() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let blocks = blocks(GUIDE);
    let mut checked = 0;
    for block in &blocks {
        let Some(label) = &block.label else {
            assert_ne!(
                block.language, "rust",
                "a Rust block without a file label:\n{}",
                block.text
            );
            continue;
        };
        let (path, excerpt) = match label.trim_end_matches(':').split_once("`, excerpt") {
            Some((path, _)) => (path.trim_start_matches('`'), true),
            None => (label.trim_end_matches(':').trim_matches('`'), false),
        };
        let file = std::fs::read_to_string(root.join(path))
            .unwrap_or_else(|err| panic!("the guide shows {path}, which is missing: {err}"));
        if excerpt {
            assert!(
                file.contains(&block.text),
                "the guide's excerpt of {path} is not in the file:\n{}",
                block.text
            );
        } else {
            assert_eq!(block.text, file, "the guide's {path} differs from the file");
        }
        checked += 1;
    }
    assert!(checked >= 10, "only {checked} labelled blocks found");
}
