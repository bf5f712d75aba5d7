// Package doclinks checks the repository's Markdown: every link to a file
// must name one in the repository that exists, so that a clone carries no
// dead links (a link to ../shared/DESIGN.md, outside it, was one).
package doclinks

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

var (
	// [text](target) and ![alt](target), target up to a space (a title
	// may follow) or the closing parenthesis; and [label]: target.
	inline    = regexp.MustCompile(`!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)`)
	reference = regexp.MustCompile(`^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+"[^"]*")?\s*$`)
	codeSpan  = regexp.MustCompile("`[^`]*`")
	// URLs point at the web, not at a file; they cannot be checked
	// offline and are left alone.
	url = regexp.MustCompile(`^[a-zA-Z][a-zA-Z0-9+.-]*:`)
)

func TestMarkdownLinksStayInTheRepository(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	files := markdownFiles(t, root)
	if len(files) == 0 {
		t.Fatalf("no Markdown files found under %s", root)
	}
	links := 0
	for _, rel := range files {
		for _, l := range linksIn(t, filepath.Join(root, rel)) {
			links++
			if msg := check(root, rel, l.target); msg != "" {
				t.Errorf("%s:%d: link %q %s", rel, l.line, l.target, msg)
			}
		}
	}
	t.Logf("checked %d links to files in %d Markdown files", links, len(files))
}

// markdownFiles lists the repository's Markdown files, relative to root:
// those git tracks or would (not the ignored); outside a git checkout,
// every .md file under root but the build and cache folders.
func markdownFiles(t *testing.T, root string) []string {
	if out, err := exec.Command("git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", "*.md").Output(); err == nil {
		return strings.FieldsFunc(string(out), func(r rune) bool { return r == 0 })
	}
	var files []string
	err := filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == ".cache" || d.Name() == "bin") {
			return filepath.SkipDir
		}
		if !d.IsDir() && strings.HasSuffix(p, ".md") {
			rel, _ := filepath.Rel(root, p)
			files = append(files, rel)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return files
}

type link struct {
	line   int
	target string
}

// linksIn returns the links of a Markdown file that name a file: not
// those inside code (fenced blocks, code spans), URLs or anchors alone.
func linksIn(t *testing.T, path string) []link {
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []link
	fence := ""
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64*1024), 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		trimmed := strings.TrimSpace(line)
		if fence != "" {
			if strings.HasPrefix(trimmed, fence) {
				fence = ""
			}
			continue
		}
		if strings.HasPrefix(trimmed, "```") || strings.HasPrefix(trimmed, "~~~") {
			fence = trimmed[:3]
			continue
		}
		line = codeSpan.ReplaceAllString(line, "")
		var targets []string
		for _, m := range inline.FindAllStringSubmatch(line, -1) {
			targets = append(targets, m[1])
		}
		if m := reference.FindStringSubmatch(line); m != nil {
			targets = append(targets, m[1])
		}
		for _, tg := range targets {
			if url.MatchString(tg) || strings.HasPrefix(tg, "#") {
				continue
			}
			out = append(out, link{n, tg})
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return out
}

// check says what is wrong with a link to target from the file rel, or "".
func check(root, rel, target string) string {
	p, _, _ := strings.Cut(target, "#")
	if strings.HasPrefix(p, "/") {
		return "is an absolute path: write it relative to " + rel
	}
	abs := filepath.Join(root, filepath.Dir(rel), p)
	if in, err := filepath.Rel(root, abs); err != nil || in == ".." || strings.HasPrefix(in, "../") {
		return "points outside the repository: a clone has no such file; put what it names in the repository and link that"
	}
	if _, err := os.Stat(abs); err != nil {
		return "names a file that does not exist (" + filepath.Join(filepath.Dir(rel), p) + ")"
	}
	return ""
}
